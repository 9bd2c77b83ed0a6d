"""Start the Twinkle server from ``server_config.yaml`` next to this file (seed 004's layout, Megatron back-end).

    python cookbook/client/server/megatron/server.py        # or: bash cookbook/client/server/megatron/run.sh
    twinkle server add-user me --config cookbook/client/server/megatron/server_config.yaml   # prints an API key

Further arguments are ``twinkle server``'s flags and override the file (``--port 0``, ``--state-dir DIR``,
``--ray --replicas 2``). Then run a client with that key: ``cookbook/client/twinkle/self_host/*.py`` or
``cookbook/client/tinker/self_host/*.py``. The server runs until interrupted (Ctrl-C).
"""

import sys
from pathlib import Path

from twinkle.server.cli import main

CONFIG = Path(__file__).with_name("server_config.yaml")

if __name__ == "__main__":
    sys.exit(main(["--config", str(CONFIG), *sys.argv[1:]]))
