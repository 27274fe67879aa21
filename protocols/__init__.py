"""The contract both sides of pfl-edge import: messages, topics, tensor codec, algorithm configs."""
