"""pinvault's tests."""
