"""Seed 004's ``python cookbook/client/server/megatron/server.py``: the Twinkle server on megatron-core.

It serves ``server_config.yaml`` next to this file (``use_megatron: true``; needs
``pip install 'twinkle-model[megatron]'``) exactly as ``../transformer/server.py`` serves its own: add a user
with ``twinkle server add-user me --config cookbook/client/server/megatron/server_config.yaml``, pass
``twinkle server`` flags to override the file (``--port 0``, ``--state-dir DIR``), and run any client with
that key. The server runs until interrupted (Ctrl-C).
"""

import sys
from pathlib import Path

from twinkle.server.cli import main

if __name__ == "__main__":
    sys.exit(main(["--config", str(Path(__file__).parent / "server_config.yaml"), *sys.argv[1:]]))
