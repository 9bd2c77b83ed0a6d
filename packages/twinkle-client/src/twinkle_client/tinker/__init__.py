"""The official ``tinker`` SDK against a Twinkle server (``pip install 'twinkle-client[tinker]'``).

```python
from twinkle_client import init_tinker_client, input_feature_to_datum
init_tinker_client("http://127.0.0.1:8000", api_key="tml-...")  # before creating Tinker clients
import tinker
training_client = tinker.ServiceClient().create_lora_training_client(base_model=..., rank=16).result()
training_client.forward_backward([input_feature_to_datum(f) for f in batch], "cross_entropy")
```

Importing this package does not import ``tinker``; the functions that need it
do, and name the extra to install when it is missing.
"""

from twinkle_client.tinker.convert import datum_to_input_feature, input_feature_to_datum
from twinkle_client.tinker.paths import to_tinker_path
from twinkle_client.tinker.sdk import init_tinker_client

__all__ = ["datum_to_input_feature", "init_tinker_client", "input_feature_to_datum", "to_tinker_path"]
