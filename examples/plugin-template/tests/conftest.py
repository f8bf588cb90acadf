# The conformance kit is a pytest plugin; plugin authors enable it here.
pytest_plugins = ["powertrain.testing"]
