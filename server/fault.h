/* fault.h — allocation fault injection in the DETATTN_FAULT_INJECT test build (fault.c);
 * no-ops otherwise. */
#ifndef DA_FAULT_H
#define DA_FAULT_H

#ifdef DETATTN_FAULT_INJECT
void da_fault_init(void);  /* reads DA_FAULT_AT and DA_FAULT_FROM; call first in main() */
void da_fault_ready(void); /* the daemon is listening: DA_FAULT_FROM=ready starts counting */
#else
static inline void da_fault_init(void) {}
static inline void da_fault_ready(void) {}
#endif

#endif /* DA_FAULT_H */
