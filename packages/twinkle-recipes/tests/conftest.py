import os
import tempfile

os.environ.setdefault("TWINKLE_CACHE_DIR", tempfile.mkdtemp(prefix="twinkle-test-cache-"))
