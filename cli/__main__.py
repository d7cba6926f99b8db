"""``python -m cli``: the same as ``rollout-fleet``."""

import sys

from cli.main import main

sys.exit(main())
