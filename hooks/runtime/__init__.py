"""Runtime layer: choose an InferenceRuntime and turn it into a vendor-neutral serving Pod."""
