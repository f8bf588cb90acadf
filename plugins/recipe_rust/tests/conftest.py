# The conformance kit is a pytest plugin; plugin packages enable it here.
pytest_plugins = ["powertrain.testing"]
