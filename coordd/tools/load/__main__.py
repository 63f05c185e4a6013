import sys

from coordd.tools.load.cli import main

sys.exit(main())
