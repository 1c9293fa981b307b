"""Two processes load the tiny policy from an empty model cache (tests/test_distributed.py): rank 0 builds the model
folder, the other waits for it (transformers writes a model's weights on rank 0 alone)."""
import sys

from clemprm import distributed

distributed.init_from_environment()
from clemprm.models.generation import load_policy  # noqa: E402

policy = load_policy({"spec": "tiny:0", "threads": 1}, sys.argv[1])
print(f"rank {distributed.rank()} loaded {policy.name}", flush=True)
