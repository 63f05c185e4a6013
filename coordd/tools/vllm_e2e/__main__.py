import sys

from coordd.tools.vllm_e2e.check import main

sys.exit(main())
