"""Carriers of the wire contract: one interface, an in-process hub and MQTT (paho-mqtt 2.x)."""
