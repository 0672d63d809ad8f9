import sys

from dynamo.cli.main import main

sys.exit(main())
