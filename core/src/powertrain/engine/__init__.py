"""The engine: requests and sequences, the KV block manager, the model runner, the
sampler and the loop that drives them. Everything here is hot path: it calls the
components assembly built, never the plugin manager."""
