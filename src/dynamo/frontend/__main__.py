"""``python -m dynamo.frontend``: Dynamo 1.x's command line, which lives in the cli layer (cli/v1/frontend.py)."""
from dynamo.cli.v1.frontend import main

raise SystemExit(main())
