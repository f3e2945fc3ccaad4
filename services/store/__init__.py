"""The store: contributes one DRAM segment (huge pages where reserved) to the Mooncake pool."""
