import sys

from dynamo.run.cli import main

sys.exit(main())
