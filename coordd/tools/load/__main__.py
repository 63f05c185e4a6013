import sys

from coordd.tools.load import main

sys.exit(main())
