"""Engine integrations: thin translations from engine types into the core's. No cache logic."""
