"""DeepSpeed adapters for dsq_plugins::

    import deepspeed_ext as dx
    engine, opt, loader, sched = dx.initialize(model=model, model_parameters=model.parameters(),
                                               config="ds_config.json")   # with a "doublesqueeze" section
    dx.DoubleSqueezeBackend(mpu=None, compressor="sign").compressed_allreduce(buf, worker_error, server_error, 0)
    dx.install()     # from now on a plain deepspeed.initialize (HF Trainer, Accelerate) honours the section too

The section's keys are ``ReducerConfig``'s options; ``install()`` patches
DeepSpeed (with an undo for every patch) so that the engines HF Trainer and
Accelerate build honour it.
"""
from .backend import DoubleSqueezeBackend
from .engine import SECTION, attach, initialize, install, installed, load_config, split_config, uninstall

__all__ = ["DoubleSqueezeBackend", "SECTION", "attach", "initialize", "install", "installed", "load_config",
           "split_config", "uninstall"]
