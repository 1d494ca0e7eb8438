"""Regenerate docs/config.md from the config models (the same as `python -m ray_cluster_ft._config_docs`).

    python scripts/gen_config_docs.py           # write docs/config.md
    python scripts/gen_config_docs.py --check   # exit 1 when it is stale
"""

import sys

from ray_cluster_ft._config_docs import main

if __name__ == "__main__":
    sys.exit(main())
