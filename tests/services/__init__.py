"""Real servers that tests run against, each started privately for one test run."""
