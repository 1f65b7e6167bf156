"""The test model zoo: the small models and helpers the tests share (``tests/`` is on the
path through pytest's ``pythonpath`` setting).

- :mod:`zoo.lm`: a tiny causal language model and fixed calibration figures for the fit planner;
- :mod:`zoo.graph`: an attention block, backends that refuse some ops, FX compilation;
- :mod:`zoo.hooks`: stacks of blocks, BERT and a UNet from configs, state snapshots;
- :mod:`zoo.commands`: a module's real commands started side by side, each a fresh process;
- :mod:`zoo.peer`: bitsandbytes held to the specification in compatibility tests (named xfails
  where its kernels depart from it on this machine), and a checkpoint decoded by the spec.
"""
