total 4764
-rw-r--r-- 1 root root   89434 Nov 28 18:29 mlp.json
-rw-r--r-- 1 root root 4786704 Nov 28 18:29 table.gsemb
