"""The study: train and benchmark one draft per layer set (`run`) and keep each outcome (`outcomes`)."""
