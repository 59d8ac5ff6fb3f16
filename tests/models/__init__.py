"""Models from other libraries trained with EPL. Hugging Face libraries stay offline: nothing is downloaded."""

import os

for _name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):
    os.environ.setdefault(_name, "1")
