"""DSpark: confidence-scheduled, load-aware speculative decoding (a powertrain plugin).

Each step, for the whole batch at once, DSpark decides how many draft tokens of each
request are worth verifying, from the drafts' calibrated confidences and the target's
measured steps per second at each batch size; verification is lossless rejection
sampling. Modules: ``lengths`` (the choice), ``verify`` (rejection sampling),
``ngram`` and ``mtp`` (drafters), ``calibration`` (per-position temperature
scaling, ECE), ``policy`` (the three put together), ``plugin`` (registration).
"""
