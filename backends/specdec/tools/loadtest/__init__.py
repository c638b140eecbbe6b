"""Load tests for served specdec models: Locust users, the load matrix, its report and the
keep / roll-back verdict (`specdec loadtest`)."""
