"""Tools on top of the core and serving: benchmarks, load tests, demo, model kit."""
