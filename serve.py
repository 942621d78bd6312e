"""`python serve.py ...` from a checkout: the same as the `pipeserve` command
(pipeserve/launch/serve.py)."""
from pipeserve.launch.serve import main

if __name__ == "__main__":
    main()
