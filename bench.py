"""`python bench.py ...` from a checkout: the benchmark (pipeserve/bench/run.py)."""
import sys

from pipeserve.bench.run import main
from pipeserve.launch.overrides import expand_home

if __name__ == "__main__":
    sys.argv[1:] = expand_home(sys.argv[1:])   # `model.path=~/x` as in a shell
    main()
