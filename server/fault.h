/* fault.h — fault injection in the DETATTN_FAULT_INJECT test build (fault.c): allocation
 * failures and forced thread orders; no-ops otherwise. */
#ifndef DA_FAULT_H
#define DA_FAULT_H

#ifdef DETATTN_FAULT_INJECT
void da_fault_init(void);  /* reads DA_FAULT_AT and DA_FAULT_FROM; call first in main() */
void da_fault_ready(void); /* the daemon is listening: DA_FAULT_FROM=ready starts counting */
/* Called by the transport where libnng reports a connection's ADD_POST (on libnng's thread,
 * no lock held): waits DA_FAULT_CONNECT_DELAY_MS, if set. */
void da_fault_connect_delay(void);
#else
static inline void da_fault_init(void) {}
static inline void da_fault_ready(void) {}
static inline void da_fault_connect_delay(void) {}
#endif

#endif /* DA_FAULT_H */
