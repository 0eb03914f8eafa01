"""P4 (benchmarks/README.md): out-of-core AdamW step with all optimizer state on NVMe vs the IO lower bound.

Runs `luwu bench offload-step --json` in several rounds (each round measures its
own IO bound, planner profile and serialised baseline in the same process) and
reports the median of the per-round ratios step_s / io_bound_s, beside the
overlap speed-up (serialised / overlapped). Target P4: <= 1.05.

    python benchmarks/bench_offload_step.py --nvme-dir /mnt/nvme --params 256M --rounds 3
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

P4_TARGET = 1.05


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nvme-dir", required=True, help="directory on the disk under test (not tmpfs)")
    parser.add_argument("--params", default="256M")
    parser.add_argument("--unit-params", default="16M")
    parser.add_argument("--host-mem", default="2GiB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None,
                        help="results markdown (default benchmarks/results/<date>-offload-step.md)")
    args = parser.parse_args()
    rows = []
    for r in range(args.rounds):
        cmd = [sys.executable, "-m", "luwu_rt", "bench", "offload-step", "--params", args.params, "--unit-params",
               args.unit_params, "--host-mem", args.host_mem, "--nvme-dir", args.nvme_dir, "--json"]
        # Its stderr passes through: a failing round shows the command's own error line.
        out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True).stdout
        rows.append(json.loads(out))
        row = rows[-1]
        print(f"round {r + 1}: step {row['step_s']:.3f} s, IO bound {row['io_bound_s']:.3f} s "
              f"({row['step_s'] / row['io_bound_s']:.2f}x), predicted {row['predicted_s']:.3f} s, "
              f"serialised {row['serial_step_s']:.3f} s", flush=True)
    ratio = statistics.median(r["step_s"] / r["io_bound_s"] for r in rows)
    overlap = statistics.median(r["serial_step_s"] / r["step_s"] for r in rows)
    verdict = "meets" if ratio <= P4_TARGET else "misses"
    print(f"P4: step / IO bound = {ratio:.2f}x (median of {len(rows)} rounds; target <= {P4_TARGET}x: {verdict}); "
          f"overlap speed-up {overlap:.2f}x")
    date = datetime.date.today().isoformat()
    path = Path(args.out or Path(__file__).parent / "results" / f"{date}-offload-step.md")
    lines = [f"# P4: out-of-core optimizer step, {date}", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, "
             f"load average {os.getloadavg()[0]:.1f} at the end. "
             f"Command: `{' '.join(sys.argv)}`.", "",
             "| round | params | step s | IO bound s | ratio | predicted s | serialised s | disk read GB/s "
             "| disk write GB/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rows, 1):
        lines.append(f"| {i} | {r['params']} | {r['step_s']:.3f} | {r['io_bound_s']:.3f} "
                     f"| {r['step_s'] / r['io_bound_s']:.2f} | {r['predicted_s']:.3f} | {r['serial_step_s']:.3f} "
                     f"| {r['disk_read_gbps']:.2f} | {r['disk_write_gbps']:.2f} |")
    lines += ["", f"**P4: {ratio:.2f}x the IO lower bound** "
              f"(median of per-round ratios; target <= {P4_TARGET}x: {verdict}). "
              f"Overlap speed-up over the same plan serialised: {overlap:.2f}x.", ""]
    path.write_text("\n".join(lines))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
