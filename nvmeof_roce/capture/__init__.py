"""Packet captures decoded: pcap/pcapng files and the RoCE v2 frames with NVMe-oF capsules in them."""
