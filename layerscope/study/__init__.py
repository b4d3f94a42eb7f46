"""The study: train and benchmark one draft per layer set (`run`), keep each outcome (`outcomes`), rank sets without
training (`probe`) and recommend one (`recommend`)."""
