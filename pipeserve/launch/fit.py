"""`pipeserve fit [overrides]`: will the model fit? The admission memory model (weights, KV per
token of the chosen layout, the largest context, the rows that fit) from the checkpoint's files,
printed without loading the weights. Main thread; the same overrides as a launch."""
from __future__ import annotations

import sys

from pipeserve.launch import checks as launch
from pipeserve.config import check_overrides, load_config
from pipeserve.errors import ConfigError
from pipeserve.model.fit import estimate


def main(args: list[str]) -> None:
    """Print the estimate for the launch `args` would make; a config error is one line on
    stderr and exit code 2, as a launch's is."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    conf = launch.conf_dir()
    try:
        check_overrides(args)
        launch.check_overrides_compose(conf, args)
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
            cfg = load_config(compose("serve", overrides=args))
        fit = estimate(cfg)
    except ConfigError as e:
        launch.fail(f"config error: {e}")
    finally:
        GlobalHydra.instance().clear()
    print("\n".join(fit.lines()))
    sys.stdout.flush()
