/*
 * config.h — detattnd's settings, defined once in a table (config.c) that parses flags,
 * the config file and the environment, checks bounds and generates --help.
 *
 * Precedence, lowest first: built-in defaults < config file (inih; key = flag name without
 * the dashes, sections ignored) < environment (DETATTND_<NAME>, name upper-cased with '-'
 * as '_') < command-line flags (--name value or --name=value). The file is named by
 * --config or DETATTND_CONFIG.
 *
 * Thread: start-up only.
 */
#ifndef DA_CONFIG_H
#define DA_CONFIG_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define DA_CONFIG_STR_MAX 512

typedef struct da_config {
  char config_file[DA_CONFIG_STR_MAX];
  char listen[DA_CONFIG_STR_MAX]; /* "" until da_config_load fills the default */
  int backend;                    /* index into "auto|cpu|cuda" */
  /* model */
  int layers, q_heads, kv_heads, head_dim;
  int dtype; /* da_dtype: 0 bf16, 1 fp16 */
  int page_tokens;
  int64_t kv_tokens; /* KV capacity in tokens, rounded up to whole pages */
  int window;
  double softcap, scale; /* scale 0: 1/sqrt(head_dim) */
  /* numerics */
  int split_tokens, tile_tokens;
  /* scheduler and limits */
  int max_batch_tokens;
  int wait_us;
  int max_request_tokens;
  int partial_rows;
  int decode_tokens, max_prefill_tokens;
  int64_t max_message_bytes;
  int max_seqs, max_seq_tokens;
  /* resources */
  int threads, contexts, acc_slots, staging_mib, device;
  /* connections and shutdown */
  int max_connections, max_conn_per_peer, max_inflight_per_conn;
  int client_max_seqs;
  int64_t client_max_kv_tokens, client_max_inflight_tokens;
  int send_timeout_ms, idle_timeout_ms, drain_timeout_ms;
  int64_t max_reply_bytes; /* replies queued on one connection */
  int64_t max_arena_bytes;
  int max_arenas;
  int cuda_event_timeout_ms;
  int doorbell;          /* offer the same-host doorbell (ipc:// with the shared-memory plane) */
  int doorbell_spin_us;  /* loop: scan active doorbell rings this long after their last activity */
  int doorbell_spin_max_us; /* loop: or up to this long, 1.5x a ring's last reply-to-request gap; -1: auto */
  int worker_spin_us;    /* worker: wait this long for the next batch spinning before sleeping; -1: auto */
  int worker_spin_max_us; /* worker: or up to this long, 1.5x its last idle gap; -1: auto */
  int spin_late_us;       /* loop and worker: a spin's yield back this late gives way; 0: never */
  int phase_timing;       /* diagnostics: decode Forwards' phases logged at exit */
  char ipc_mode[16];       /* octal permissions of the ipc socket */
  char tls_cert[DA_CONFIG_STR_MAX], tls_key[DA_CONFIG_STR_MAX], tls_ca[DA_CONFIG_STR_MAX];
  int insecure_tcp;        /* tcp:// on a non-loopback address without TLS was asked for */
  char allow_uids[DA_CONFIG_STR_MAX], allow_gids[DA_CONFIG_STR_MAX], stats_uids[DA_CONFIG_STR_MAX];
  int log_level; /* da_log_level */
  int log_format; /* da_log_format: 0 text, 1 json */
  char http_listen[DA_CONFIG_STR_MAX]; /* "" (off) or http://HOST:PORT: /metrics, /healthz, /readyz */
  int fail_after_batches; /* tests: batch N and later fail as a device failure; 0: off */
  int help;         /* --help was given */
  int print_config; /* --print-config was given */
} da_config;

/* Parses a comma-separated list of ids ("0,1000"; "" is empty) into out (at most max);
 * returns the count, or -1 when an entry is not a number. */
int da_config_id_list(const char *s, uint32_t *out, int max);
/* The ipc socket mode (ipc_mode parsed as octal). */
int da_config_ipc_mode(const da_config *c);

/* Names of the enum settings' values, for printing. */
const char *da_config_backend_name(const da_config *c);

/*
 * Fills c from defaults, the config file, envp (NULL-terminated "NAME=value" strings, may
 * be NULL) and argv[1..argc). On error returns DETATTN_INVALID_ARGUMENT with a message
 * naming the setting, its source, the value and the bounds. --help sets c->help and stops
 * parsing (no other checks); --print-config likewise sets c->print_config.
 */
int da_config_load(da_config *c, int argc, char *const argv[], char *const envp[], char *err,
                   size_t errlen);

/* Writes the usage text, one block per setting: flag, type, bounds, default, help. */
void da_config_help(FILE *f);

/* Writes a commented example config file with every setting at its default. */
void da_config_example(FILE *f);

#endif /* DA_CONFIG_H */
