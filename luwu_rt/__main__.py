import sys

from luwu_rt.cli.main import main

sys.exit(main())
