import sys

from coordd.tools.load.command import main

sys.exit(main())
