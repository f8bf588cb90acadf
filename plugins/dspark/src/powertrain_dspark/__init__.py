"""DSpark: confidence-scheduled, load-aware speculative decoding (a powertrain plugin).

Each step, for the whole batch at once, DSpark decides how many draft tokens of each
request are worth verifying, from the drafts' calibrated confidences and the target's
measured steps per second at each batch size; verification is lossless rejection
sampling. Modules: ``lengths`` (the choice), ``verify`` (rejection sampling),
``drafter`` (what drafters return), ``ngram`` and ``mtp`` (drafters),
``confidence_head`` (the MTP drafter's learned confidence) and ``training`` (fitting
it), ``calibration`` (per-position temperature scaling, ECE), ``policy`` (the three
put together), ``plugin`` (registration).
"""
