"""Virtual devices' local updates trained together: one stacked computation per round."""
