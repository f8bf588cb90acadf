"""Deployment: how engines are started and fed, above assembly.

* ``launch``: ``start_engine(config)``, what ``LLM``, ``powertrain generate`` and
  ``powertrain serve`` call: one process (a plain ``LLMEngine``), worker processes
  spawned on this machine, or ranks under ``torchrun`` on several;
* ``worker``: one rank's process loop (build its engine, take requests, run steps);
* ``frontend``: ``ParallelEngine``, the engine-shaped front end over every rank;
* ``balance``: the front end's choice of data-parallel rank (longest cached prefix,
  then least loaded).

Imports point down: deploy uses ``powertrain.assemble`` (which wires engines) and the
mechanisms in ``powertrain.parallel``; nothing below imports deploy.
"""
