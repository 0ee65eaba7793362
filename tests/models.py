"""Random-weight models for tests (no oracle logic here)."""
import numpy as np

from cism.dense import Config, Model, weight_shapes


def dense_weights(config, seed=0, scale=0.3, untied_head=None):
    """Random weights of a dense config; norms near 1 so activations stay lively."""
    rng = np.random.default_rng(seed)
    has_head = (not config.tied) if untied_head is None else untied_head
    out = {}
    for name, shape in weight_shapes(config, has_head).items():
        if len(shape) == 1:
            out[name] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[name] = (rng.standard_normal(shape) * scale / np.sqrt(shape[1]) * 3).astype(np.float32)
    return out


def small_config(model_type="llama", **kw):
    base = dict(model_type=model_type, hidden=64, intermediate=96, layers=2, heads=4, kv_heads=2,
                head_dim=16, vocab=97, context=512, eps=1e-6, rope_theta=10000.0, tied=False)
    base.update(kw)
    return Config(**base)


def small_model(model_type="llama", precision="fp32", threads=2, seed=0, kv_precision="fp32", **kw):
    config = small_config(model_type, **kw)
    return Model(config, dense_weights(config, seed), precision=precision, threads=threads,
                 kv_precision=kv_precision)
