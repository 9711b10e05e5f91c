"""DeepSpeed adapters for dsq_plugins.

    import deepspeed_ext as dx
    engine, opt, loader, sched = dx.initialize(model=model, model_parameters=model.parameters(),
                                               config="ds_config.json")   # with a "doublesqueeze" section
    dx.DoubleSqueezeBackend(mpu=None, compressor="sign").compressed_allreduce(buf, worker_error, server_error, 0)
"""
from .backend import DoubleSqueezeBackend
from .engine import SECTION, attach, initialize, load_config, split_config

__all__ = ["DoubleSqueezeBackend", "SECTION", "attach", "initialize", "load_config", "split_config"]
