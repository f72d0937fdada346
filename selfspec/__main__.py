import sys

from selfspec.tools.cli import main

sys.exit(main())
