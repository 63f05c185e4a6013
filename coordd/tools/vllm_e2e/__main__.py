import sys

from coordd.tools.vllm_e2e.cli import main

sys.exit(main())
