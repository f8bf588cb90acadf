"""powertrain's cache tiers on a Redis or Valkey server (``[components] kv_store = "redis"``)."""
