"""Helpers every stage of the sweep shares."""
import re
import warnings

# Module names of the vision/audio/... towers: their layer lists are not the text decoder's.
TOWER = re.compile(r"vision|visual|video|audio|image|vq|perceiver|qformer|projector|patch|speech|protein|mtp")


def auto_class(config):
    """AutoModelForCausalLM where it takes this config class (the sweep builds the causal LM where there is one),
    else the class quantkit builds the model with (image-text-to-text; a config registered under another model
    type, Evolla's)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from quantkit.models.hub import model_class

    return AutoModelForCausalLM if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING else model_class(config)


def without_cache(model) -> dict:
    """use_cache=False, for a model whose forward takes it (by name, or through **kwargs to the inner model): the
    comparisons run one forward and need no cache, and some families' cache cannot be asked its length when no
    layer is an attention layer (Bamba's and GraniteMoeHybrid's default configs are all Mamba)."""
    import inspect

    parameters = inspect.signature(model.forward).parameters.values()
    takes = any(p.name == "use_cache" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
    return {"use_cache": False} if takes else {}


def config_class(model_type):
    """The config class registered for model_type, or None."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type] if model_type in CONFIG_MAPPING else None


def quiet(fn, *args, **kwargs):
    """fn(...) without transformers' warnings about unusual configs (a tiny model is one by design)."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn(*args, **kwargs)
    finally:
        logging.set_verbosity(level)


def one_line(error) -> str:
    """An exception (or a stderr text) as one line: the last non-empty line, with the exception's type."""
    text = str(error).strip()
    last = text.splitlines()[-1].strip() if text else ""
    if isinstance(error, BaseException):
        return f"{type(error).__name__}: {last}"[:300]
    return last[:300]
