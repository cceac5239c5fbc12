"""The rings in shared memory (shm, ring) and the bridge that carries a ring's records between hosts. Imports only the
package's contracts (errors)."""
