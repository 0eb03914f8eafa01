"""``NodeProtocol``: the optimizer node's protocol state machine ([Note: the node protocol] in protocol.py).

It touches no socket and starts no thread: ``handle`` takes one incoming
message, ``apply`` one event of another thread (events.py), and both append
the replies to ``outbox``, which the socket loop sends (loop.py). That is what
lets the fuzz test drive it directly. Incoming messages and events are
dispatched by their type, through a table.

Phases: until every worker said HELLO with one manifest and worker 0 sent the
initial state (INIT ... LAST) the node only collects; then it WELCOMEs every
worker and the steps thread runs steps ``start_step + 1 .. steps`` (steps.py).
The join is bounded: the loop ends the node when it made no progress (a new
worker's HELLO, a fresh INIT chunk) for ``--timeout`` (``join_problem``).

[Note: strangers]
A peer that has no accepted HELLO is a stranger, and what it sends is judged
by its header alone (``peek``) before a byte of the payload is read: a
stranger may say HELLO (a manifest of at most ``MAX_HELLO_BYTES``, [Note: a
HELLO is checked whole] in manifest.py), HEARTBEAT (no payload) and, as
another node shard, NORM (one float64); anything else is dropped as it comes,
so a flood of large messages costs the node neither a CRC pass nor memory
beyond what waits in its socket (loop.py). The HELLO bytes the node reads
from one stranger are its allowance, ``STRANGER_BYTES``; past it its HELLOs
are dropped unread too.

[Note: who may join]
The first HELLO whose manifest is whole and valid, and whose run fits this
node, binds the node to that run; every later one must be equal to it. A rank
that joined is that connection's for the rest of this incarnation: a second
connection claiming it is refused and logged (with CURVE, with both
connections' key names: [Note: node keys] in auth.py), so no one takes over a
worker's rank mid-run. Refusals tell a peer what is wrong with its own HELLO;
without CURVE the peer is not authenticated, so they do not tell it the
node's values (the run's manifest, its worker and shard counts): those go to
the node's log only.
"""

from __future__ import annotations

import json
import queue
import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import Callable

import torch

from luwu_rt.plan.dtypes import full_name

from .auth import Throttled
from .chunks import Assembly, cut
from .config import NodeConfig
from .events import (Begin, Event, NormsKnown, ReadState, Refusal, StateRead, StepDone, UnitServed)
from .manifest import MAX_HELLO_BYTES, first_difference, job_id, parse_manifest
from .protocol import (DTYPE_CODES, INIT_STATES, OLDEST_HEADER, VERSION, F, Message, ProtocolError, T, decode, encode,
                       old_version, peek)
from .runner import NodeRunner
from .shards import NormHub, pack_norms, unpack_norms

__all__ = ["STRANGER_BYTES", "NodeProtocol"]

STRANGER_BYTES = 2 * MAX_HELLO_BYTES
"""HELLO bytes the node reads from one peer it has not admitted ([Note: strangers])."""
_STRANGERS = 4096
"""Strangers whose bytes the node remembers; the oldest is forgotten first."""


class NodeProtocol:
    """The state of one optimizer node's run as its messages make it."""

    def __init__(self, config: NodeConfig, *, make_runner: Callable[[dict], NodeRunner],
                 on_welcomed: Callable[[], None], between: queue.SimpleQueue, log: Callable[[str], None],
                 hub: NormHub | None = None, rollback: Callable[[int], str] | None = None) -> None:
        """``make_runner(manifest)``: the runner of this node's shard of a run; ``on_welcomed()``: the
        workers are welcomed (the service starts the steps); ``between``: requests for the steps thread
        ([Note: between two steps] in steps.py); ``hub``: shard 0's norm hub, with several node shards;
        ``rollback(step)``: a worker's ROLLBACK, which replaces this node or says why it cannot."""
        self.config = config
        self.make_runner, self.on_welcomed = make_runner, on_welcomed
        self.rollback = rollback
        self.between, self.log, self.hub = between, log, hub
        self.epoch = secrets.randbits(31) + 1
        self.rejects: Counter[str] = Counter()
        """Reason -> messages dropped: malformed, unexpected, stale or from an unknown peer."""
        self.duplicates = 0
        self.manifest: dict | None = None
        self.job = 0
        self.peers: dict[bytes, int] = {}
        """Socket identity -> worker rank, from its HELLO."""
        self.hellos: dict[int, bytes] = {}
        """Worker rank -> the socket identity that joined as it ([Note: who may join])."""
        self.keys: dict[int, str | None] = {}
        """Worker rank -> the name of the CURVE key it joined with (None without CURVE)."""
        self.progress_at = time.monotonic()
        """When the join last made progress (a worker joined, a fresh INIT chunk): the loop bounds the wait."""
        self._strangers: OrderedDict[bytes, int] = OrderedDict()
        """Identity of a peer not admitted -> the HELLO bytes read from it ([Note: strangers])."""
        self._refusals = Throttled(log, what="workers' messages")
        """Refusals a peer can repeat at will: logged while they are few."""
        self.runner: NodeRunner | None = None
        self.welcomed = False
        self.byes: set[int] = set()
        self.outbox: list[tuple[bytes, list]] = []
        """Replies the loop sends: ``(identity, frames)``."""
        self.resumed_from: int | None = None
        """The step of the snapshot this node resumed from, if it did ([Note: node snapshots])."""
        self.no_snapshot = "this node was started without --snapshot-dir"
        """Why the node holds no snapshot of a run, for a worker that rejoins one (the service sets it)."""
        self._init: dict[tuple[int, int], tuple[torch.Tensor, Assembly]] = {}
        self._init_whole: set[tuple[int, int]] = set()
        """(unit, state) of the initial states that arrived whole: a repeated INIT of one changes nothing."""
        self._init_done = False
        self.waiting: dict[tuple[int, int], list[tuple[bytes, int]]] = {}
        """(unit, step) -> the pulls ``(identity, rank)`` waiting for it to be served."""
        self._begun = 0
        self._messages: dict[int, Callable[[bytes, Message], None]] = {
            T.INIT: self._init_chunk, T.HEARTBEAT: self._heartbeat, T.PUSH_GRAD: self._push,
            T.PULL_PARAM: self._pull, T.BEGIN: self._begin, T.GET_STATE: self._get_state,
            T.ROLLBACK: self._rollback}
        """Handlers of a joined worker's messages, by type (HELLO and NORM come from anyone: ``handle``)."""
        self._during_run = {T.PUSH_GRAD, T.PULL_PARAM, T.BEGIN, T.GET_STATE, T.ROLLBACK}
        """Messages only taken once the workers were welcomed, of this node's incarnation."""
        self._events: dict[type, Callable] = {UnitServed: self._served, NormsKnown: self._norms_known,
                                              StepDone: self._step_done, StateRead: self._state_read,
                                              Refusal: self._refusal}

    def resume(self, manifest: dict, runner: NodeRunner, *, step: int) -> None:
        """The run comes from a snapshot of ``step`` (its states already in ``runner``): no INIT is awaited."""
        self.manifest, self.job, self.runner = manifest, job_id(manifest), runner
        self._init_done = True
        self.resumed_from = step

    # -- incoming messages ------------------------------------------------------------------------

    def handle(self, identity: bytes, frames: list) -> None:
        """Processes one incoming message; a bad one is dropped and counted in ``rejects``, never raised."""
        try:
            rank = self.peers.get(identity)
            if rank is None:
                self._stranger(identity, frames)
            msg = decode(frames, max_payload=self.config.max_message_bytes, trusted=bool(self.config.auth_keys))
            if msg.type == T.HELLO:
                self._hello(identity, msg, key=_key_name(frames))
                return
            if msg.type == T.NORM:  # from another node shard, not a worker
                self._norm(identity, msg)
                return
            if rank is None and msg.type == T.HEARTBEAT:
                # Likely a worker of this node's previous incarnation: our epoch tells it to say HELLO again.
                self.reply(identity, Message(T.HEARTBEAT, epoch=self.epoch))
            if rank is None or rank != msg.rank:
                raise ProtocolError("peer", "message from a peer that has not said HELLO as this rank")
            if msg.job != self.job:
                raise ProtocolError("job", "message of another run")
            if self.runner is not None:
                self.runner.pushes.heard[rank] = time.monotonic()
            handler = self._messages.get(msg.type)
            if handler is None:
                raise ProtocolError("type", f"a node does not accept {msg.name}")
            if msg.type in self._during_run:
                if not self.welcomed:
                    raise ProtocolError("early", f"{msg.name} before the node welcomed the workers")
                if msg.epoch != self.epoch:
                    raise ProtocolError("epoch", "message for an earlier incarnation of the node")
            handler(identity, msg)
        except ProtocolError as exc:
            self.rejects[exc.reason] += 1
            if exc.reason == "version":
                self._old_hello(identity, frames)
        except Exception as exc:  # a bug of ours, not the peer's: counted and logged, the node stays up
            self.rejects["internal"] += 1
            self.log(f"internal error on a message: {type(exc).__name__}: {exc}")

    def reply(self, identity: bytes, msg: Message) -> None:
        # Over CURVE the MAC guards every frame: no CRC pass ([Note: the node protocol]).
        self.outbox.append((identity, encode(msg, checksum=not self.config.auth_keys)))

    def refuse(self, identity: bytes, text: str, *, peer_text: str | None = None) -> None:
        """Logs ``text`` (throttled) and sends the peer an ERROR: ``peer_text``, or ``text``."""
        self._refusals(f"refused a worker: {text}")
        payload = (peer_text or text).encode()
        self.reply(identity, Message(T.ERROR, epoch=self.epoch, dtype=DTYPE_CODES["utf8"], payload=payload))

    def _old_hello(self, identity: bytes, frames: list) -> None:
        """A HELLO of another protocol version: refused by name, in that version's header where it shares ours
        (``OLDEST_HEADER``), so that the worker can read why ([Note: strangers]: its bytes were counted)."""
        found = old_version(frames)
        if found is None:
            return
        version, rank = found
        text = (f"worker {rank} speaks node protocol version {version}, this node version {VERSION}: run the same "
                f"luwu_rt on the node and the workers")
        self._refusals(f"refused a worker: {text}")
        reply = Message(T.ERROR, epoch=self.epoch, dtype=DTYPE_CODES["utf8"], payload=text.encode())
        same_header = OLDEST_HEADER <= version < VERSION
        self.outbox.append((identity, encode(reply, version=version if same_header else VERSION)))

    def _stranger(self, identity: bytes, frames: list) -> None:
        """Raises ``ProtocolError`` for what a peer not admitted may not send, by its header alone
        ([Note: strangers])."""
        head = peek(frames)
        if head is None:
            return  # decode says what is wrong with it
        kind, nbytes = head
        if kind == T.HELLO:
            used = self._strangers.pop(identity, 0) + nbytes
            self._strangers[identity] = used
            while len(self._strangers) > _STRANGERS:
                self._strangers.popitem(last=False)
            if nbytes > MAX_HELLO_BYTES or used > STRANGER_BYTES:
                raise ProtocolError("stranger", f"a HELLO of {nbytes} bytes, {used} in all from a peer not admitted")
        elif not (kind == T.HEARTBEAT or kind == T.NORM and nbytes <= 8):
            raise ProtocolError("peer", "message from a peer that has not said HELLO")

    def _hello(self, identity: bytes, msg: Message, *, key: str | None = None) -> None:
        """A worker's HELLO ([Note: who may join]); ``key``: the name of its connection's CURVE key."""
        try:
            manifest = parse_manifest(msg.payload)
        except ValueError as exc:
            self.rejects["hello"] += 1
            self.refuse(identity, f"worker {msg.rank}'s HELLO{_with(key)}: {exc}")
            return
        problem = self._hello_problem(identity, msg, manifest, key)
        if problem:
            self.rejects["hello"] += 1
            self.refuse(identity, *problem[:1], peer_text=problem[1])
            return
        if self.runner is None:
            try:
                runner = self.make_runner(manifest)
            except ValueError as exc:  # the run does not fit this node: every worker hears why
                self.rejects["hello"] += 1
                self.refuse(identity, f"{exc} (luwu node serve --host-mem / --nvme-dir)")
                return
            self.manifest, self.job, self.runner = manifest, job_id(manifest), runner
            self.log(f"run {self.job:08x}: {len(runner.numels)} units, {sum(runner.numels):,} parameters, placement "
                     f"{runner.placement}")
        if msg.rank not in self.hellos:
            self.progress_at = time.monotonic()
            self.log(f"worker {msg.rank} joined{_with(key)}")
        self.peers[identity], self.hellos[msg.rank], self.keys[msg.rank] = msg.rank, identity, key
        self._strangers.pop(identity, None)
        if self.welcomed:
            self._welcome(identity)
        else:
            self._maybe_start()

    def _hello_problem(self, identity: bytes, msg: Message, manifest: dict, key: str | None) -> tuple[str, str] | None:
        """Why this node cannot take the HELLO: ``(line for the log, line for the peer)``, each with the fix;
        the peer's leaves out the node's values unless the peer is authenticated ([Note: who may join])."""
        rank, shown = msg.rank, bool(self.config.auth_keys)
        if msg.step and self.resumed_from is None:  # a rejoin ([Note: a node that restarts] in worker.py)
            text = (f"worker {rank} rejoins its run in step {msg.step}, but this node holds no snapshot of it: "
                    f"{self.no_snapshot}. Resume the workers from their last checkpoint (luwu train --resume) "
                    f"against this node, or restart the run")
            return text, text
        joined = self.peers.get(identity)
        if joined is not None and joined != rank:
            text = f"a HELLO as worker rank {rank} from the connection of worker {joined}{_with(key)}"
            return text, f"this connection joined as worker rank {joined} already"
        shards = manifest.get("nodes", [None])
        if len(shards) != self.config.num_shards:
            text = (f"worker {rank} names {len(shards)} node address(es) in --node, but this node is shard "
                    f"{self.config.shard} of {self.config.num_shards}: list every node shard's address, in shard order")
            return text, text if shown else (f"worker {rank} names {len(shards)} node address(es) in --node, another "
                                             f"number than this node's shards (its log says which)")
        count = manifest["num_workers"]
        if count != self.config.num_workers or not 0 <= rank < count:
            text = (f"worker rank {rank} of {count} workers, but this node serves --num-workers "
                    f"{self.config.num_workers}; start both with the same count")
            return text, text if shown else (f"worker rank {rank} of {count} workers: this node serves another "
                                             f"number of workers (its log says how many); start both with the same "
                                             f"count")
        holder = self.hellos.get(rank)
        if holder is not None and holder != identity:
            text = (f"a second connection claims worker rank {rank}{_with(key)}, which joined already"
                    f"{_with(self.keys.get(rank))}: a rank is not taken over; is another process started with the "
                    f"same rank, or one that is no worker of this run?")
            return text, (f"worker rank {rank} joined this node already, from another connection: start each rank "
                          f"once (a node that restarts is joined anew)")
        found = first_difference(self.manifest, manifest) if self.manifest is not None else None
        if found:
            where, ours, theirs = found
            fix = "give every worker the same configuration (or restart the node)"
            text = (f"worker {rank}'s run differs from the one this node serves at {where}: {ours!r} != {theirs!r}; "
                    f"{fix}")
            return text, text if shown else (f"worker {rank}'s run differs from the one this node serves at {where} "
                                             f"(this worker's: {theirs!r}; the node's log says its own); {fix}")
        return None

    def _init_chunk(self, identity: bytes, msg: Message) -> None:
        """Worker 0's initial state, one state of one unit at a time ([Note: wire chunks] in chunks.py)."""
        runner = self.runner
        if self.welcomed or msg.rank != 0 or runner is None:
            raise ProtocolError("init", "initial state comes from worker 0 before the first step")
        if msg.nbytes:
            if not (0 <= msg.unit < len(runner.numels) and msg.chunk < len(INIT_STATES)
                    and msg.dtype == DTYPE_CODES["float32"]):
                raise ProtocolError("range", f"INIT of unit {msg.unit} state {msg.chunk}")
            key = (msg.unit, msg.chunk)
            if key not in self._init_whole:
                if key not in self._init and self._init:  # one staging buffer at a time: counted in --host-mem
                    raise ProtocolError("init", "INIT of another state before the last one was whole")
                buf, assembly = self._init.get(key) or self._staging(msg.unit)
                fresh = assembly.put(msg.offset, msg.payload)
                if fresh:
                    self.progress_at = time.monotonic()
                if assembly.complete:  # the unit's state is whole: into the store, the staging buffer dropped
                    runner.write_initial(msg.unit, INIT_STATES[msg.chunk], buf)
                    self._init.pop(key, None)
                    self._init_whole.add(key)
                else:
                    self._init[key] = (buf, assembly)
            else:
                fresh = False
            self.reply(identity, Message(T.ACK, flags=0 if fresh else F.DUPLICATE, job=self.job, rank=0,
                                         unit=msg.unit, chunk=msg.chunk, offset=msg.offset,
                                         epoch=self.epoch))  # the worker's credit back
        if msg.flags & F.LAST:
            missing = self._init_missing() if self.resumed_from is None else ""
            if missing:
                # Served as it stands, a unit without its master would hand the workers parameters nobody sent,
                # and its pull would wait forever: the run is refused by name instead.
                self.refuse(identity, f"worker 0's initial state ended (INIT ... LAST) without {missing}: a "
                                      f"fresh node needs every unit's master weights; restart worker 0")
                return
            self._init_done = True
            self.progress_at = time.monotonic()
            self._maybe_start()

    def _init_missing(self) -> str:
        """What of the initial state did not arrive whole: each unit's master (the moments may be left out: a fresh
        run's are zeros), and no state left part-sent; '' when nothing is missing."""
        numels = self.runner.numels
        units = [u for u, n in enumerate(numels) if n and (u, 0) not in self._init_whole and (u, 0) not in self._init]
        partial = sorted(f"unit {u} {INIT_STATES[s]}" for u, s in self._init)
        parts = ([f"the master of unit(s) {', '.join(map(str, units[:8]))}{' ...' if len(units) > 8 else ''}"]
                 if units else []) + ([f"the rest of {', '.join(partial)}"] if partial else [])
        return " and ".join(parts)

    def _staging(self, unit: int) -> tuple[torch.Tensor, Assembly]:
        buf = torch.empty(self.runner.numels[unit], dtype=torch.float32)
        return buf, Assembly([(0, buf)], chunk_bytes=self.runner.model.chunk_bytes)

    def _maybe_start(self) -> None:
        if self.welcomed or not self._init_done or len(self.hellos) < self.config.num_workers:
            return
        self.welcomed = True
        for identity in self.hellos.values():
            self._welcome(identity)
        self.log(f"{self.config.num_workers} worker(s) joined; training from step {self.runner.step}")
        self.on_welcomed()

    def _welcome(self, identity: bytes) -> None:
        payload = json.dumps({"step": self.runner.step, "adam_step": self.runner.adam_step, "epoch": self.epoch,
                              "shard": [self.config.shard_index, self.config.num_shards],
                              "snapshot_every": self.config.snapshot_every}).encode()
        self.reply(identity, Message(T.WELCOME, job=self.job, epoch=self.epoch, dtype=DTYPE_CODES["json"],
                                     payload=payload))

    def _heartbeat(self, identity: bytes, msg: Message) -> None:
        if msg.flags & F.BYE:
            self.byes.add(msg.rank)
        self.reply(identity, Message(T.HEARTBEAT, job=self.job, epoch=self.epoch))

    def _push(self, identity: bytes, msg: Message) -> None:
        if msg.dtype != DTYPE_CODES[self.runner.pushes.dtype]:
            raise ProtocolError("dtype", f"this run's gradients are pushed as {self.runner.pushes.dtype}")
        fresh = self.runner.pushes.offer(rank=msg.rank, step=msg.step, unit=msg.unit, offset=msg.offset,
                                         payload=msg.payload)
        self.duplicates += not fresh
        self.reply(identity, Message(T.ACK, flags=0 if fresh else F.DUPLICATE, job=self.job, rank=msg.rank,
                                     step=msg.step, unit=msg.unit, chunk=msg.chunk, offset=msg.offset,
                                     epoch=self.epoch))
        self._begin(identity, msg)  # a push of a step is its BEGIN too

    def _pull(self, identity: bytes, msg: Message) -> None:
        runner = self.runner
        if not 0 <= msg.unit < len(runner.numels):
            raise ProtocolError("range", f"pull of unit {msg.unit}")
        newest = runner.served.newest(msg.unit)
        if msg.step > newest + 1:
            raise ProtocolError("future", f"pull of unit {msg.unit} after step {msg.step}; served {newest}")
        if not self._send_params(identity, msg.unit, msg.step, msg.rank):
            if msg.step <= newest:
                raise ProtocolError("stale", f"unit {msg.unit} after step {msg.step} is no longer kept")
            self.waiting.setdefault((msg.unit, msg.step), []).append((identity, msg.rank))

    def _begin(self, identity: bytes, msg: Message) -> None:
        if msg.step > self._begun:  # the first word of a step wakes the steps thread; later ones need not
            self._begun = msg.step
            self.between.put(Begin(msg.step))

    def _get_state(self, identity: bytes, msg: Message) -> None:
        if not (0 <= msg.unit < len(self.runner.numels) and 0 <= msg.chunk < len(INIT_STATES)):
            raise ProtocolError("range", f"GET_STATE of unit {msg.unit} state {msg.chunk}")
        self.between.put(ReadState(identity, msg))

    def _rollback(self, identity: bytes, msg: Message) -> None:
        """Another node shard restarted at ``msg.step``: back to this shard's snapshot of it ([Note: node shards
        that restart] in worker.py); the worker hears why not, if not."""
        if self.config.num_shards == 1 or not 1 <= msg.step:
            raise ProtocolError("rollback", f"ROLLBACK to step {msg.step} of a node of {self.config.num_shards} "
                                            f"shard(s)")
        problem = self.rollback(msg.step) if self.rollback is not None else "this node cannot go back to a snapshot"
        if problem:
            self.refuse(identity, problem)

    def _norm(self, identity: bytes, msg: Message) -> None:
        """A node shard's partial norm ([Note: node shards] in shards.py); only shard 0 takes them."""
        if self.hub is None:
            raise ProtocolError("type", "NORM to a node that is not shard 0 of several")
        if msg.job != self.job:
            raise ProtocolError("job", "NORM of another run")
        if msg.dtype != DTYPE_CODES["float64"] or msg.rank == 0:
            raise ProtocolError("norm", "a NORM carries one float64 from shard 1..k-1")
        (value,) = unpack_norms(msg.payload, 1)
        self.hub.offer(msg.step, msg.rank, value, identity, epoch=msg.epoch)

    # -- outgoing ranges and events of other threads ----------------------------------------------

    def _send_params(self, identity: bytes, unit: int, step: int, rank: int) -> bool:
        runner = self.runner
        buf = runner.served.get(unit, step)
        if buf is None:
            return False
        # A view of the served buffer, sent without a copy: it is rewritten two steps later at the
        # earliest, after every worker received it ([Note: double-buffered parameters] in runner.py).
        self._send_range(identity, T.PARAM, buf, dtype=DTYPE_CODES[full_name(runner.manifest["dtype"])],
                         rank=rank, step=step, unit=unit)
        return True

    def _send_range(self, identity: bytes, kind: int, buf: torch.Tensor, *, index: int | None = None,
                    **fields) -> None:
        """``buf``'s bytes as wire chunks ([Note: wire chunks] in chunks.py), ``LAST`` on the final one;
        ``chunk`` is the chunk's index, or ``index`` (a state's, for STATE)."""
        size = self.runner.model.chunk_bytes
        chunks = cut([(0, buf)], chunk_bytes=size)
        for i, (offset, payload) in enumerate(chunks):
            self.reply(identity, Message(kind, flags=F.LAST if i == len(chunks) - 1 else 0, job=self.job,
                                         epoch=self.epoch, chunk=offset // size if index is None else index,
                                         offset=offset, payload=payload, **fields))

    def apply(self, event: Event) -> None:
        """An event of another thread (events.py), dispatched by its type."""
        self._events[type(event)](event)

    def _served(self, event: UnitServed) -> None:
        for identity, rank in self.waiting.pop((event.unit, event.step), []):
            self._send_params(identity, event.unit, event.step, rank)

    def _norms_known(self, event: NormsKnown) -> None:
        for identity, parts in self.hub.replies(event.step):
            self.reply(identity, Message(T.NORM, job=self.job, step=event.step, dtype=DTYPE_CODES["float64"],
                                         payload=pack_norms(parts)))

    def _step_done(self, event: StepDone) -> None:
        for identity, rank in list(self.peers.items()):
            self.reply(identity, Message(T.STATS, job=self.job, rank=rank, epoch=self.epoch,
                                         dtype=DTYPE_CODES["json"], payload=event.stats))

    def _refusal(self, event: Refusal) -> None:
        self.refuse(event.identity, event.text)

    def _state_read(self, event: StateRead) -> None:
        msg = event.request
        self._send_range(event.identity, T.STATE, event.values, index=msg.chunk, rank=msg.rank, step=msg.step,
                         unit=msg.unit, dtype=DTYPE_CODES["float32"])

    def join_problem(self) -> str:
        """What the node still waits for before it welcomes the workers, as the line it exits with."""
        missing = [r for r in range(self.config.num_workers) if r not in self.hellos]
        if len(missing) == self.config.num_workers:
            what = f"any worker's HELLO (of {self.config.num_workers})"
        elif missing:
            more = " ..." if len(missing) > 8 else ""
            what = f"the HELLO of worker(s) {missing[:8]}{more} (joined: {sorted(self.hellos)[:8]})"
        else:
            what = "worker 0's initial state (INIT ... LAST)"
        return (f"no run began within {self.config.timeout:g}s without progress: waited for {what}; start the workers "
                f"with --node {self.config.bind if '*' not in self.config.bind else 'ADDRESS'} and --nproc "
                f"{self.config.num_workers} (or raise --timeout)")

    def flush_log(self) -> None:
        """Logs how many refusals were not logged one by one, if any."""
        self._refusals.flush()

    def failure(self, text: str) -> list[tuple[bytes, list]]:
        """The ERROR every joined worker gets when the node fails."""
        return [(identity, encode(Message(T.ERROR, epoch=self.epoch, dtype=DTYPE_CODES["utf8"], payload=text.encode())))
                for identity in self.hellos.values()]


def _with(key: str | None) -> str:
    return f" (key {key})" if key else ""


def _key_name(frames: list) -> str | None:
    """The name of the CURVE key of the connection ``frames`` came on (the ZAP user id, [Note: node keys] in
    auth.py); None without CURVE, or for frames that are no ZeroMQ frames (tests)."""
    get = getattr(frames[0], "get", None) if frames else None
    if get is None:
        return None
    try:
        return get("User-Id") or None
    except Exception:  # zmq.ZMQError: the connection has no user id (no CURVE)
        return None
