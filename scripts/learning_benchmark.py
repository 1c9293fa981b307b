"""An alias of ``python -m clemprm.bench learning`` (:mod:`clemprm.bench.learning`, where its options and what it
runs are described): the same function with the same options, messages led by ``learning_benchmark.py``.

    python scripts/learning_benchmark.py --seeds 7 11 42 --split test [--workdir runs/learning] [--cores 2] ...
"""

from clemprm.bench.learning import main

if __name__ == "__main__":
    main()
