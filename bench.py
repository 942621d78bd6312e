"""`python bench.py ...` from a checkout: the benchmark (pipeserve/bench/run.py)."""
from pipeserve.bench.run import main

if __name__ == "__main__":
    main()
