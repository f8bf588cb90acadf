pytest_plugins = ["powertrain.testing"]
