"""The state every rank must share: model variables and optimizer variables.

Used by the callbacks (broadcast, checkpoint resume) and by the Estimator."""

import warnings

from kerasdist import ops, runtime


def build_optimizer(model):
    """Creates the optimizer's variables now if Keras has not yet (it defers them to the first
    step); True when they exist afterwards. A model that is not built yet cannot be helped."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return True
    if not optimizer.built and model.built and model.trainable_variables:
        optimizer.build(model.trainable_variables)
    return optimizer.built


def model_state_variables(model):
    """The model's variables that every rank must share, in the same order on every rank.

    Random-seed states (`SeedGenerator`, used by dropout) stay per rank: ranks should draw
    different dropout masks, as different samples of one large batch would.
    """
    return [v for v in model.variables if not v.path.endswith("seed_generator_state")]


def training_state_variables(model):
    """`model_state_variables(model)`, then the variables of the model's optimizer (if built)."""
    variables = model_state_variables(model)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and optimizer.built:
        variables += list(optimizer.variables)
    return variables


def broadcast_training_state(model, root_rank=0):
    """Gives every rank `root_rank`'s model and optimizer variables (a collective)."""
    if runtime.state().size > 1:
        ops.broadcast_variables(training_state_variables(model), root_rank=root_rank)


def turn_off_xla(model):
    """kerasdist's ops have no XLA kernels: a model compiled with jit_compile=True is switched
    to jit_compile=False (with one warning) before Keras traces its functions."""
    if getattr(model, "jit_compile", False):
        warnings.warn(
            "kerasdist: the model was compiled with jit_compile=True; kerasdist's collectives "
            "cannot run under XLA, so it now runs with jit_compile=False",
            stacklevel=3,
        )
        model.jit_compile = False
        model.train_function = model.test_function = model.predict_function = None
