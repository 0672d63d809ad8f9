"""``python -m dynamo.planner``."""

import sys

from dynamo.planner.cli import main

sys.exit(main())
